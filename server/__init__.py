"""edgefl server: round orchestration over MQTT, aggregation strategies, evaluation and reports."""
