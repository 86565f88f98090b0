"""One module of graders per lab (lab00.py, lab01.py, ...), each registering with `exercise`."""
