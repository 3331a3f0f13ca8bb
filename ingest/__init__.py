"""Stage 2 of the data's journey: land every Kafka record in the Delta ``bronze`` archive, exactly once."""
