"""The messages actors exchange, below every actor that sends or receives them.

``engine``: the worker's, the scheduler's, the detokenizer's and the frontend's unions;
``offload``: the KV offload manager's (``OffloadMsg``) and its statistics.
"""
