"""LoRA adapters served beside one base model: their files (`adapter`), the frontend's table of
names (`registry`), the worker's device slots and host cache (`slots`), what adapters may be
(`limits`, no torch: the flags are checked with it). The linear layers that add
an adapter's delta to each row of a batch are the model's (`sonar.models.lora`); what a request
carries of its adapter is the core's (`sonar.core.request.LoRARequest`)."""
