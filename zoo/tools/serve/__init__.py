"""``zoo serve build|start|stop|status|refresh-keys``: the zoo's models behind TorchServe 0.12.

Why it launches TorchServe's Java frontend itself instead of calling ``torchserve --start``: the
launcher keeps one global pid file in /tmp (so only one server per machine, and ``--stop`` stops
whichever that is), writes ``logs/`` and ``key_file.json`` into whatever the current directory is,
and runs the workers with whichever ``python`` it was started from. Here every piece of runtime
state (model store, logs, key file, pid, config) lives in one run dir (default
``~/.cache/alstm-zoo/serve``, or ``--run-dir`` / ``$ZOO_SERVE_DIR``), several servers can run side
by side on other ports, a server is stopped by its own PID, and the workers run with this
interpreter (``--python``), the environment where ``zoo`` is importable, so the handler computes
with the library's own code.

Defaults are the secure ones: 127.0.0.1 only, token authorisation on, no model registration over the management
API, bounded request sizes, and HAProxy in front of the inference port (the "front door",
``serving/haproxy.cfg``, :mod:`zoo.tools.serve.front_door`): TorchServe 0.12 has no read timeout, decodes form
bodies itself (a bad %-escape was its own 500) and runs any HTTP method on /predictions, so the front door receives
every whole request within a deadline first, checks the server's key (256 bits; TorchServe's own keys are 48),
passes only the zoo's routes with JSON or text bodies to TorchServe's own inference address (a unix socket in a
private folder), and answers everything else in JSON. Turning authorisation or the front door off is an explicit
flag.

Every process of a server (the proxy, the Java frontend and, through its process group, the workers) and every
port is recorded in the run dir's server.json: ``status`` names the part that is down, ``stop`` ends them all
by PID and process group (never by name) and waits until every port is free.

One module per job, each imported from where it lives (this package re-exports nothing):

- :mod:`~zoo.tools.serve.config`: the settings (:class:`ServerConfig`, :class:`ArchiveOptions`), ``ServeError``,
  the run dir's layout and state file, model specs;
- :mod:`~zoo.tools.serve.archive`: a checkpoint packed as a ``.mar`` (``build_archive``);
- :mod:`~zoo.tools.serve.launch`: Java, ports, TorchServe's and the front door's processes;
- :mod:`~zoo.tools.serve.lifecycle`: ``start_server`` and ``stop_server``, step by step;
- :mod:`~zoo.tools.serve.health`: readiness at start and ``server_status`` later;
- :mod:`~zoo.tools.serve.keys`: the key files, their expiry and ``refresh_keys``;
- :mod:`~zoo.tools.serve.probe`: a loopback HTTP GET of the server's own endpoints;
- :mod:`~zoo.tools.serve.front_door`: HAProxy's files and admin socket;
- :mod:`~zoo.tools.serve.supervise`: the record of every process and port, and ending them by PID;
- :mod:`~zoo.tools.serve.cli`: the sub-commands (``add`` registers them, see :mod:`zoo.tools.commands`).
"""
