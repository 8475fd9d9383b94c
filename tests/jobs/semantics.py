"""Checks plain `python script.py` semantics and that multiprocessing's spawn works; prints what it saw."""

import json
import multiprocessing as mp
import os
import sys


def square(x):
    return x * x


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        squares = pool.map(square, [1, 2, 3])
    print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "squares": squares,
                      "file": os.path.abspath(__file__)}), flush=True)
