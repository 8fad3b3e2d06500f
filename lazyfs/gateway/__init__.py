"""`lazyfs gateway`: one address for a fleet of node agents (issue 25).

It serves the agent's HTTP API unchanged (docs/api.md), so `lazyfs.client.Client`, the
async client and `lazyfs sandbox` work against a gateway as against one agent, and it
keeps no state of its own: a sandbox id names its node (ids.py), so any replica routes
any call, and a restart loses nothing.

- fleet.py: the nodes (a static list and/or a DNS name resolved again periodically),
  each polled for its placement report (the agent's GET /placement); a node that does
  not answer leaves placement until it answers again.
- placement.py: where a create goes (cache-aware, or random for comparison), as plain
  functions of the reports.
- pools.py: a pool's fleet-wide size spread over the image's first nodes.
- api.py: the routes; server.py: the sockets and the event loop; cli.py: the command.

docs/gateway.md is the user's view: how a trainer on many nodes uses one URL, and how
the store, the gateways and the agents scale.
"""
