"""The fleet: devices reached over SSH, shared by the stages that touch them (train, build, deploy).

`inventory` reads the TOML list of devices, `ssh` connects with verified host keys, `probe` learns what a device
is, `classes` names the engines a device can load, and `names` checks every name that becomes a path on a device.
No module here imports a stage.
"""
