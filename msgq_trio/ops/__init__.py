"""Operations: configuration file and reload, logging setup, control commands, traffic
capture and the Prometheus endpoint (docs/CONFIG.md, docs/CAPTURE.md).

Nothing here is on the routing hot path: the broker calls into this package only through
its command registry, its capture ``tap`` (None while nothing listens) and its disconnect
hook.
"""
