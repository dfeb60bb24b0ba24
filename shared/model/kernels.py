"""`python -m shared.model.kernels` (make setup): build the C++ kernels now rather than at a service's start."""

from __future__ import annotations

import logging

from shared.model import cpu_attention, small_ops, tiles


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lib = cpu_attention.load_kernel()
    print(f"cpu attention kernel: {lib._name if lib is not None else 'not built; auto runs the torch backend'}")
    products = tiles.load_kernel()
    print(f"product kernel: {products._name if products is not None else 'not built; products run in oneDNN'}")
    ops = small_ops.load_kernel()
    fallback = "not built; the norms, rotary, residual adds and SiLU run as torch ops"
    print(f"small-ops kernel: {ops._name if ops is not None else fallback}")


if __name__ == "__main__":
    main()
