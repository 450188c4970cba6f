"""The built-in graphs, installed as `mmhandoff.graphs` (this folder is that package).

`mmhandoff serve graphs.<name>:<Component>` looks for `graphs/<name>.py` in the working directory
first (a user's own graph, or this checkout's), then for the built-in `mmhandoff.graphs.<name>`.
"""
