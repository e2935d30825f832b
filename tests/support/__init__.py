"""What the tests share, one module per kind of help; import from the module that holds it.

* `config`: the run config tests train with (`nano_config`, `nano_overrides`).
* `ports`: `free_port`, a free TCP port on a loopback address.
* `waiting`: `wait_until` and `wait_until_async`, polls with a deadline that fail naming
  what they waited for.
* `swarm`: local swarms of real `dilonode run` processes on 127.0.0.1, their JSON events
  read with deadlines, and `assert_one_model`, the end-of-run invariant.

The package imports nothing itself, so a benchmark can take `free_port` without the rest.
"""

__all__: list[str] = []
