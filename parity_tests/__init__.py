"""Cross-framework parity suite and CLI (`python -m parity_tests`)."""
