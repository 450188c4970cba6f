"""Running components: Dynamo runtime helpers (runtime), one component's process (launch,
health), graphs (graph) and their supervisor (supervisor), the `mmhandoff` command (cli)."""
