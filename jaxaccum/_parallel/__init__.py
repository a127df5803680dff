"""The parallel wing: the core run on replicas and stages.

``_data_parallel`` runs the core per data shard inside ``shard_map`` (``data_axis``), with
the parameters placed as ``DataParallel`` says (FSDP gathers and scatters), and reduces the
carry once after the loop through the core's ``combine_carry``; ``_local`` gives each
device's own, unreduced gradients (``local_value_and_grad``, for ``MultiSteps(data_axis=)``);
both, and Linen's ``axis_name``, run each replica through ``_data_parallel.on_replicas``;
``_pipeline`` runs GPipe over a stage axis on the core's split and merge.
"""
