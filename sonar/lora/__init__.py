"""LoRA adapters served beside one base model: their files (`adapter`), the frontend's table of
names (`registry`), the worker's device slots and host cache (`slots`), and the linear layers
that add an adapter's delta to each row of a batch (`layers`)."""
