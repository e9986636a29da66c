"""FlashRT benchmark scripts (see bench/README.md)."""
