"""The web console (``msgq-trio console``, docs/CONSOLE.md): a client of the broker that
serves a live page of the bus (clients, groups, commands, queues, traffic) and runs an
operator's actions through the broker's access rules.

:mod:`.model` turns broker answers into view data (no I/O), :mod:`.service` polls the
broker once per interval for every viewer and runs the actions, :mod:`.app` is the thin
Starlette app, :mod:`.cli` the command line; ``static/`` holds the page's own HTML, CSS,
SVG and JavaScript.
"""
