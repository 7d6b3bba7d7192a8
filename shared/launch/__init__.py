"""Starting the mesh on one machine: the `deepinfer` command, `deepinfer up`'s options and plan, the launcher
that spawns and supervises the services, the nats-server it runs, and the checks made before anything starts."""
