"""Adapters that let agent frameworks keep the model state `flashrt serve` holds for them.

Rule: integrations/ speaks to a running server over HTTP only (its public endpoints); it imports
no flashrt module, so it works from a process that never loads torch. Each adapter is one module,
imported by name (its framework is an optional extra): langgraph.py holds RetainingSaver, a
LangGraph checkpointer that retains the capsules behind its checkpoints' responses, and
idempotent(), which gives each model call in a graph node an Idempotency-Key.
"""
