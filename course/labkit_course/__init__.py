"""The course "Inside an LLM inference engine" on top of the engine `labkit`: its graders and grading
sandbox, the notebook generator, the book's worked example, roofline helpers and the Colab setup cell.

The engine never imports this package; the course drives the engine only through labkit's public API.
"""
