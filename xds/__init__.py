"""The control channel: xDS transport semantics on grpcio (see DESIGN.md)."""
