"""Optional integrations with serving engines; each imports its engine only on its own."""
