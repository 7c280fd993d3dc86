"""The wire: how the server's clients talk to a model, framework-free (no TorchServe, no HTTP server here).

* :mod:`zoo.api.http`: HTTP statuses and both error shapes, torch-free (the front door renders its own replies
  with it too);
* :mod:`zoo.api.service`: the one request schema (score, generate) and service core behind every front end (the
  server, the demo, the CLI);
* :mod:`zoo.api.dialects`: the :class:`~zoo.api.dialects.Dialect` contract and the registry of wire formats:
  :mod:`zoo.api.native` (``POST /predictions/<model>``) and :mod:`zoo.api.completions` (OpenAI's
  ``POST /v1/completions``);
* :mod:`zoo.api.scheduler`: fair sharing of one model between requests of any dialect.

``serving/handler.py`` adapts this to TorchServe; ``zoo/tools/serve/`` starts the server and its front door.
"""
