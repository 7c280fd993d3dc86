"""A finished run's release: bundling it into the catalogue and `zoo/pretrained/` (`bundle.py`, `zoo bundle`), its
model card from `templates/` (`cards.py`), and publishing it to the Hub (`publish.py`, `zoo publish`). Checkout
tooling: nothing in the library imports it."""
