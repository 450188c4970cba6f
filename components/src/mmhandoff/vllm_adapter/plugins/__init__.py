"""vLLM general plugins (entry point `vllm.general_plugins`, pyproject.toml): vLLM loads them in
every one of its processes, the API process and the engine core's included: keeping idle engine
processes off the CPU (spin, held_kv), ending an engine's processes quickly (fast_exit) and with
their parent (parent_death), the AMX state vLLM's CPU attention needs (amx); their settings'
parsing (plugin_setting)."""
