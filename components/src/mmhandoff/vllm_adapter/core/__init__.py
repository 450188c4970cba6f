"""What vLLM loads by dotted path into its engine core process (and its model workers): the
fail-closed scheduler (`scheduler_cls`) and the NIXL connector (`kv_connector_module_path`).
Nothing here runs in the worker's own process."""
