"""edgefl device runtime and SDK: local training on the device, reporting over MQTT."""

__version__ = "0.1.0"
