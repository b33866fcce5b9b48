"""SFT on branching conversations: the loop (`loop`) and the data format (`data`)."""
