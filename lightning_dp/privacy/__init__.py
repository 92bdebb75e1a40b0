"""The privacy core: what decides the guarantee, in one folder (docs/architecture.md)."""
