"""Entry script for spark-submit: ``spark-submit [options] .../msgq_trio/analytics/submit.py
capture|scenarios ARGS...`` runs ``msgq-trio analyze`` with the master and resources
spark-submit was given. Absolute imports only: spark-submit runs this file as a script,
so msgq_trio must be installed in the Python it uses."""

import sys

from msgq_trio.analytics.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
