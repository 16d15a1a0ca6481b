"""The multi-process runtime: processes joined through jax.distributed, each supervised,
and tensor-parallel placement of weights over them."""
