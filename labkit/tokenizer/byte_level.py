"""GPT-2's printable spelling of bytes, used by GGUF, `tokenizers` and our save files.

Each of the 256 byte values maps to one visible Unicode character (a space becomes 'Ġ',
a newline 'Ċ'), so a token's bytes can be written as text and a merge as "Ġ t".
"""


def _byte_to_char() -> dict[int, str]:
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in visible}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR = _byte_to_char()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def bytes_to_printable(data: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in data)


def printable_to_bytes(token: str) -> bytes:
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError as err:
        raise ValueError(f"token {token!r} has a character {err.args[0]!r} outside the byte-level alphabet") \
            from None
