"""How many collectives this process has entered (the full counter arrives separately)."""


def count() -> int:
    return 0
