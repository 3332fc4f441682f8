"""Fakes that run flare-exporter's real code paths without the hardware they stand in for."""
