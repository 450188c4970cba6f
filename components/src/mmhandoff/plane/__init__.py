"""The internal plane every component talks on: the Dynamo runtime (runtime: endpoints, clients,
typed errors), discovery registration and its loss (registration), the addresses and ports a
component binds (addresses, ports), the name of every endpoint (endpoints), and the keys that
sign handoffs (handoff_keys). Nothing here knows of engines."""
