"""Virtual time's parts: the replay on a virtual clock (``replay``), the schemes it compares
(``schemes``), the study and its report (``study``); ``lora_guard.bench.virtual_time`` is the
command."""
