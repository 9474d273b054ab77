"""Engine core: request state, scheduling, hybrid cache management, wire messages and the engine loop."""
