"""What assembles the library into programs: the demo, trace replay, the stress
harness and the ``tiering`` command."""
