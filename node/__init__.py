"""What both front doors share (the CRI proxy and the NRI plugin): the conversions between the
runtime's messages, the hooks' views and the store's records, and the store itself."""
