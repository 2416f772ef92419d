"""Small user programs for exec scenarios: written as a team would write its own
components (the public client library, the broker's address from MSGQ_TRIO_SOCKET), and
recording their operations in MSGQ_TRIO_HISTORY for the history checks
(:mod:`msgq_trio.scenario.history`)."""
