"""CuTe DSL kernel sources. Importing these needs nvidia-cutlass-dsl (build machine only)."""
