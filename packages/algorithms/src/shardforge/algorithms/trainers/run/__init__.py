"""What runs around every trainer's step loop: the hang watchdog, the stop signal, profiling, start-up GC and threads."""
