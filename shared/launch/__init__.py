"""Starting the mesh on one machine: the `deepinfer` command, `deepinfer up`'s options and plan, the launcher
that spawns and supervises the services, the nats-server it runs, and the checks made before anything starts.

The one place in shared/ that reads services' modules: `deepinfer up` takes its defaults from their settings records
(services/gateway/config.py, services/recipe/config.py: frozen dataclasses, no I/O, torch-free), so each default
is written once. Nothing else of a service is imported here; the services themselves run as processes.
"""
