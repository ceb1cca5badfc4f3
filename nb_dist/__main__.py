"""``python -m nb_dist demo``: the same as the ``nb-dist`` command."""

from nb_dist._cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m nb_dist"))
