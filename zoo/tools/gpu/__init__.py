"""The GPU ferry: a training piece on a lent GPU machine (`piece.py`, `piece.sh`), the steps here around it
(`trip.sh`), the pack that carries a run there and back within the device tool's limits (`ferry.py`), and the pack
committed between pieces (`runpack.py`). Checkout tooling: nothing in the library imports it."""
