"""Test machinery, never imported by SCOUT's production modules (the ``scout`` command's parser takes its
``scout cells`` commands from :mod:`~scout_core.testing.cells_cli`, which imports nothing else of it at load).

* :mod:`scout_core.testing.launcher`: forks N gloo ranks from a parent that already imported torch;
* :mod:`scout_core.testing.cells`: the named fault-injection cells of ``configs/cells.yaml`` and their runner;
  :mod:`~scout_core.testing.cells_cli` the ``scout cells`` commands; :mod:`~scout_core.testing.lanes` the cells
  that mostly wait, run side by side;
* :mod:`scout_core.testing.inject`: the fault injector the cells drive (bit flips, delays, freezes, kills).
* :mod:`scout_core.testing.plugins`: a framework plugin's version gate and entry point, as its tests check them.

They ship with scout-core so that a plugin's or a user's own cells can use them; a training job never needs them.
"""
