"""Adapters that give code written against another project's modules the same names, backed by syncless.

:mod:`syncless.compat.vllm` ports vLLM's hidden-sync check and its
Confidential Computing copies with a one-line import change (see
``docs/porting-from-vllm.md``). Unlike a capability package, an adapter sits
on top of the capabilities and imports them (``syncs``, ``cc``), as the demo
and the bench do; no capability imports it. Importing it touches no CUDA API.
"""

__all__ = ["vllm"]
