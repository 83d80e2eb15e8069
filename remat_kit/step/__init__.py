"""The one training step that plan, auto, fit, bench and train compile, and the mesh it is sharded over.

Pure JAX and optax, below the wings: the generic planner compiles a user's loss with it without loading the
built-in model or its training (:mod:`remat_kit.step.update`: the update, its optimizer and its trainable part;
:mod:`remat_kit.step.mesh`: data parallelism and FSDP; :mod:`remat_kit.step.allocator`: on CPU, freed step buffers
returned to the OS, so the process's memory follows the compiled plan).
"""
