"""Read models: what the API, the dashboard and /metrics show. Nothing here changes state.

The API's views of jobs, attempts, nodes, events and checkpoints (``views``); the cluster summary
(``cluster``); the dashboard's pages (``dashboard``); Prometheus metrics (``metrics``); goodput
(``goodput``); layout plans (``plans``) and goodput simulations (``simulations``) over the pure
models.
"""
