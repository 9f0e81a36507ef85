"""NRI mode: crihook as a Node Resource Interface plugin of the container runtime. The wire (ttrpc
framing, NRI's connection multiplexer) and the plugin's connection to the runtime live here; the
hooks it runs are the same as the CRI proxy's."""
