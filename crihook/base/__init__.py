"""The base layer: configuration, logging, metrics, input errors, quantities, the device-allocation
annotation and the container-spec value types. It imports nothing of crihook above it, so every other
package may use it."""
