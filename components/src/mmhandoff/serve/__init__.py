"""`mmhandoff serve`: a graph's components as local processes (graph: the YAML and the
components' wiring; supervisor: start, restart, stop; gpus: which GPU each engine gets), and the
`mmhandoff` command (cli)."""
