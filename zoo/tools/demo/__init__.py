"""The Gradio demo (`app.py` at the repository root is its entry point): its launch (`launch.py`: options, page,
server), the models (`registry.py`), the endpoint functions (`handlers.py`), the tabs (`ui.py`), the rendering
(`render.py`), the route guard (`guard.py`) and dynamic evaluation's statistics (`stats.py`). Checkout tooling:
nothing in the library imports it."""
