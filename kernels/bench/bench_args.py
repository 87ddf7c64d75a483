"""The options the PyTorch bench scripts share with rnnd-kernel-bench: comma lists, one case per
combination (--cell gru,lstm --batch 1,1024 ...), and the timing options."""

import argparse


def int_list(s):
    return [int(v) for v in s.split(",")]


def float_list(s):
    return [float(v) for v in s.split(",")]


def str_list(s):
    return s.split(",")


def parser(description, batch, input_size, hidden, reset_prob, repeat):
    """A parser with the shared options and the script's defaults; the script adds its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--cell", type=str_list, default=["gru"])
    ap.add_argument("--batch", type=int_list, default=[batch])
    ap.add_argument("--input", type=int_list, default=[input_size])
    ap.add_argument("--hidden", type=int_list, default=[hidden])
    ap.add_argument("--layers", type=int_list, default=[1])
    ap.add_argument("--reset-prob", type=float_list, default=[reset_prob])
    ap.add_argument("--compute", type=str_list, default=["fp32"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--seed", type=int, default=1)
    return ap
