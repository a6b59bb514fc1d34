"""Deciding what moves: pressure sources, the eviction controller and its parts
(device eviction, reload admission, the host cascade), its table and counters."""
