"""Chat data → tokenized chats with assistant masks → feature shards → DataModules."""
